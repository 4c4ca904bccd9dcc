"""placeholder"""
from verl.checkpoint_engine.base import CheckpointEngineManager


class FTStateCheckpointEngineManager(CheckpointEngineManager):
    pass
