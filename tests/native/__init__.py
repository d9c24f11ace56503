"""Checks of the native kernel library built for other ISAs (run_arm_checks.py)."""
