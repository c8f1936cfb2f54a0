"""The kernel lab: earlier steps of the optimisation ladders, kept runnable for comparison.

Nothing in the product imports this package: a kernel plan (kernels/plan.py) picks only the
variants of kernels/gluon/. The development scripts (scripts/kernel_dev/gluon_check.py,
scripts/kernel_dev/kernel_report.py, ...) time and compile these beside the production kernels, and
kernels/LOG.md tells what each step measured.
"""
