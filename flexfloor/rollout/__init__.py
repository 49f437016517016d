"""Rollout: the generation engine, the release protocol and the scheduler."""
