"""The restaurant demo: a domain that only uses the engine.

Its tools (`catalog`), the catalog the engine loads (`plugin`), the wire protocol of its
system of record (`protocol`), the client and provider the executor calls (`client`,
`provider`) and the demo system of record itself (`sor`).
"""
