"""Training integration: presets named after the papers, a gradient reducer with checkpointable
state and statistics, a DDP communication hook, and `allreduce_gradients` for code without DDP."""
