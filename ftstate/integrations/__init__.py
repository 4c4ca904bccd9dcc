"""Adapters that plug ftstate into RL frameworks, each imported only when its framework loads it by name, so
the core and the controller never import a framework."""
