"""agentbus: the library that the worker, the sweeper and busctl share.

Producers (an orchestrator written in Python) use :mod:`shared.client`.
"""
