"""Configuration shared by every package, at the bottom of the layering.

- :mod:`lsconfig.config_io`: YAML files into frozen dataclasses, with errors that name the file, the
  field, what was expected and what was found (model/hardware/sweep configs, the monitor config);
- :mod:`lsconfig.envs`: the ``LAYERSPLIT_*`` environment variables, typed, in one place;
- :mod:`lsconfig.paths`: where the shipped configs are (the checkout's ``configs/`` or the wheel's copy).

It imports nothing from the project, so ``dsa_kernels`` (compute only), ``hicache``, ``layersplit``
and ``pd`` may all use it.
"""
