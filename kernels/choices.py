"""The words that choose our kernels, per direction: `kernel=` of kernels.flash_attention and the
config's `attention.kernel` (training/config/schema.py reads them from here, so this imports nothing).
kernels/plan.py says what each word runs."""
CHOICES = ("auto", "triton", "gluon")
