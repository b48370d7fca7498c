"""autoshard: auto-sharding planner for ML models over N-D device meshes."""

__version__ = "0.1.0"
