"""The persistent tier: `Checkpoints` over Orbax's CheckpointManager, the folder's lock and contents, and how a run resumes."""
