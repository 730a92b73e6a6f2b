"""Who may do what: staff accounts (`staff`, `usernames`, `passwords`), console sessions
(`sessions`), API tokens (`api_tokens`), login limits (`login_limits`), the FastAPI
dependencies that authenticate and authorize (`auth`) and the console's security headers
(`security_headers`). The login page itself is a console page (`app.console.login`).

Wing order: `access` may import `http`, never `calls`, `ops`, `legs`, `console` or `cli`.
"""
