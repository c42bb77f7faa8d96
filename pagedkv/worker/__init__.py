"""Runs the model for one rank: input preparation (the one slot-mapping builder), CoW block
copies and the forward pass. Imported by the single-process engine and by the
tensor-parallel workers alike (it imports nothing of ``engine`` or ``distributed``)."""

from pagedkv.worker.runner import ModelInput, ModelRunner

__all__ = ["ModelInput", "ModelRunner"]
