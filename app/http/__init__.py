"""The HTTP transport's own concerns: read deadlines and per-source connection bounds
(`guard`), request body limits (`body_limits`), bounded slots (`slots`), provider signatures
(`signatures`), liveness, readiness and metrics (`health`).

Wing order: the lowest wing; `http` imports no other wing.
"""
