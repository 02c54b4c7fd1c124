"""How a worker's steps run: one step program per model, chosen once at start-up by
:func:`ingot.worker.execution.select.select_step_program`, warmed up before the engine reports
ready, then asked once per step (``program.forward``) how that step's batch runs."""
