"""A call of any leg: its row and status machine (`store`), the live registry of this process
(`registry`), liveness (`liveness`), ending a call from any replica (`control`), its events
(`events`), its recording (`recording`, `recording_store`), the calls list (`query`) and the
timeline (`timeline`).

Wing order: `calls` may import `access` and `http`, never `ops`, `legs`, `console` or `cli`
(tests/test_import_graph.py).
"""
