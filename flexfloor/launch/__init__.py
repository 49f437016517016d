"""Launchers: the Ray launcher (`python -m flexfloor.launch.ray`), the resource pool of released
workers (`pool.py`), the Slurm command builders (`python -m flexfloor.launch.slurm`), the reaper
of a dead worker's helpers (`reaper.py`), a tool's stop signals (`stop.py`) and torchrun with the
workers' exit code (`python -m flexfloor.launch.local`, which examples/train_moe.sh runs).
torchrun needs nothing from here: `torchrun ... -m flexfloor.train`. See docs/launch.md."""
