"""The mathematics, in numpy only (``docs/method.md``): nothing here imports torch or a file.

* :mod:`kvdiverge.theory.coupling`: total variation, the stepwise maximal coupling, common
  random numbers, EOS as one outcome;
* :mod:`kvdiverge.theory.risk`: divergence times, TV profiles, risks and their decompositions;
* :mod:`kvdiverge.theory.identification`: what the observed laws identify, and the bounds;
* :mod:`kvdiverge.theory.survival`: SWRB's survival weights;
* :mod:`kvdiverge.theory.finite_state` and :mod:`kvdiverge.theory.finite_state_study`: the
  finite-state family, exact values and estimators.
"""
