"""Process groups and collectives (spec: parallelism-and-speculation.md §0-3).

``layouts`` holds the rank layouts and the parallel-config validation as pure functions;
``group`` the GroupCoordinator over torch.distributed; ``parallel_state`` the process-wide
groups a worker joins (``get_tp_group()``).
"""
