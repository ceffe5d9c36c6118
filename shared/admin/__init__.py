"""Operator tools: ``busctl``, the status document, ``busctl serve`` with its
dashboard and metrics, the KPIs and the demo. Everything here reads through
the other packages; nothing here changes a task except through ``agentbus.queue``.
"""
