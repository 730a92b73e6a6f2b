"""After-call work and operations: late results reaching the caller (`delivery`,
`delivery_jobs`), SMS (`sms`, `sms_resend`, `routes_sms`), the workers (`worker`), the
provider's callbacks and staff requests on operations (`routes_operations`,
`operation_actions`, `operation_query`), deliveries over HTTP (`routes_deliveries`) and the
Twilio REST client (`twilio_rest`).

Wing order: `ops` may import `calls`, `access` and `http`, never `legs`, `console` or `cli`.
"""
