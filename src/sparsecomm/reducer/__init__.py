"""Gradients averaged over ranks, one call at a time: `GradientReducer` (reducer.py) takes a named
tensor or a DDP bucket (buckets.py), chooses its route (call.py) and hands it to that route's path
(paths/: plain, compressed, rows, dense_step), posts its collective where the step's calls go
(step_calls.py), and finishes every sum the same way (completion.py). config.py holds what every
rank agrees on, checkpoint.py the checkpoint's format, ddp_hook.py and custom_loop.py the ways in."""
