"""The guides' result blocks, generated from recorded runs: renderers (:mod:`.tables`,
:mod:`.experiment_tables`), stage code digests (:mod:`.code_digest`) and the ``fedhisto records``
command (:mod:`.record_blocks`); the blocks are registered in :mod:`fedhisto.registries.record_registry`."""
