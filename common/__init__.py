"""What clients and servers agree on: one definition each, imported by both sides.

Fixed-point encoding, share splitting and the PRG that expands seed shares (``encoding``,
``sharing``, ``prg``), the client API's wire schema (``wire``), the deployment config
(``service_config``), and the domain's definitions. Imports only ``net`` and numpy: a client
loads no 2PC engine because nothing here can reach one.
"""
