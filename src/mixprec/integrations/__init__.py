"""Adapters that run mixprec inside training frameworks: thin layers over :class:`mixprec.MixedPrecision`.

* ``mixprec.integrations.transformers``: ``MixprecTrainer`` (and ``MixprecTrainerMixin`` for other
  ``transformers.Trainer`` subclasses), a Hugging Face ``Trainer`` whose every step goes through mixprec.
* ``mixprec.integrations.accelerate``: ``MixprecAccelerator``, an ``accelerate.Accelerator`` whose
  ``prepare``/``backward``/``clip_grad_norm_``/``optimizer.step()`` are mixprec's.
* ``mixprec.integrations.lightning``: a precision plugin for Lightning's ``Trainer`` and ``Fabric``.

The frameworks are optional dependencies: importing this package imports none of them; each
submodule imports its framework when one of its classes is first used, and says how to install it
when it is missing. The adapters call ``MixedPrecision`` and never reimplement it: every way a
framework reaches the step does what mixprec does or raises. See ``docs/integrations.md``.
"""

#: The adapters are the submodules above, imported by name (each pulls in its framework); the
#: package itself exports nothing.
__all__: list[str] = []
