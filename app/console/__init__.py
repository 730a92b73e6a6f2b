"""The staff console: `pages` (server-rendered HTML), `login` (login and logout), `api` (the
JSON API and its OpenAPI schema), `views` (what both serve: lists and details as JSON fit
for the asking role), `schemas` (request and response bodies), views of a call
(`call_view`, `swimlanes`, `masking`), live updates (`live`), `templating` with
`templates/` and `static/`, the console's services (`services`) and its installation into
the app (`install`).

Wing order: `console` may import every wing but `cli`.
"""
