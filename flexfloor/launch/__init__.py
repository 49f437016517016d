"""Launchers: the Ray launcher (`python -m flexfloor.launch.ray`), the resource pool of released
workers (`pool.py`) and the Slurm command builders (`python -m flexfloor.launch.slurm`).
torchrun needs nothing from here: `torchrun ... -m flexfloor.train`. See docs/launch.md."""
