"""Differential privacy building blocks for local training.

- ``per_sample``: per-unit gradients of the declared trained tensors with ``torch.func`` (one image with all its
  views is one sample; a clearance family with ``privacy.unit: family``);
- ``dpsgd``: units, Poisson sampling, micro-batch packing, clipping, Gaussian noise;
- ``step`` and ``site``: one logical step from those pieces, and a site's DP-SGD over rounds (plan check,
  budget stop, ledger, exact resume) for the local training loop to call;
- ``releases``: the noised prototype upload (its own noise multiplier) and a round's releases for the ledger;
- ``rdp`` and ``accountant``: RDP of the sampled Gaussian, the per-site ledger and the budget check;
- every piece takes what it differentiates, clips and noises as an argument (``per_sample.Trained``: the
  tensors a method's objective declares it trains, with masks); the wrapper that asks the objective for
  it, and refuses a configuration by name, is ``fedhisto.train.private``;
- ``audit`` and ``attack``: membership-inference statistics, the loss-difference attack, canaries.

What DP covers here and what it does not: ``docs/privacy.md``.
"""
