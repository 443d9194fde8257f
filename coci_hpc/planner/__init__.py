"""Pure planning core: convergence fit, failure model, costs, policies, simulator, frozen plan.

No I/O and no subprocesses here: values in, a frozen :class:`Plan` out.
"""
