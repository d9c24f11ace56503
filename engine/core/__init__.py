"""The engine's core: the loop on the engine thread (engine_loop.py, async_steps.py),
the parts it is built from (engine_setup.py), the scheduler and its request records
(scheduler.py, requests.py), the routing of outputs to their callers
(output_router.py) and the pause gate (pause_gate.py). The scheduler's side imports
no torch."""
