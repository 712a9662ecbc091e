"""The ``adaptive`` pipeline's controller: every step it measures the compute, the link and the
gradient, and chooses what is worth sending — every entry in fp32 or fp16, the largest entries at
the density that moves the most gradient energy per second of step, or each matrix as a low-rank
product.

config.py (`Mode`, `Plan`, `AdaptiveConfig`) · measurement.py (one rank's step) · report.py (what
a rank tells every rank) · report_exchange.py (reports riding on the next step's calls) ·
costs.py (what each mode costs, the density worth sending) · trials.py (side-by-side comparisons
that change the mode) · planner.py (a plan per step) · controller.py (the planner's loop inside a
reducer) · link_probe.py, calibration.py, gradient_energy.py (what is measured once or sampled) ·
flush.py, density.py (the pipeline's state on dense steps and between sparse ones)."""
