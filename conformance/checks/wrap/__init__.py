"""Part W of ``conformance/SPEC.md``: the FSDP1 auto-wrap utilities (area ``wrap``).

``policies.py``   what each policy callable answers (W1, W8, W9);
``plans.py``      the side-effect-free plan builder, ``build_wrap_plan`` (W1-W5, W9-W12);
``auto_wrap.py``  the FSDP1 constructor with ``auto_wrap_policy`` (W1-W6, W8-W12);
``applying.py``   the helpers that walk and wrap (W7, W13-W16, W20) and ``fully_shard`` along a
                  plan;
``ignored_states.py``  FSDP1's ``ignored_states`` / ``ignored_modules`` element types (W18);
``mp_override.py``     the batch-norm mixed-precision override: the helper (W19) and the units'
                  dtypes under bf16 (W11).
Helpers: ``_cases.py`` (the zoo cases and the rules their expected plans come from), ``_models.py``
(the zoo's models), ``_helpers.py`` (reaching private wrap utilities, reading FSDP1's units).
"""
