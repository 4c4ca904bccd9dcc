"""Adapters that plug ftstate into the RL frameworks people run (verl first).

Each integration is a module of its own, imported only when its framework loads it by name
(e.g. verl's ``custom_backend_module``), so the core and the controller never import a
framework. An integration uses the transport and the controller like any caller would.
"""
