"""The engine core: the step loop that schedules, runs the worker and applies its output; beam
search; what crosses between the core and its clients."""
