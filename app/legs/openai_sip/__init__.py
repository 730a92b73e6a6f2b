"""OpenAI's SIP interconnect: `routes` (POST /openai/webhook), `webhooks` (deliveries taken
once, by webhook-id) and `calls` (accept, the sideband socket, the call until it ends).
"""
