"""Callbacks that put a trainer a user already has into a federation: Hugging Face's ``Trainer``
and TRL's ``SFTTrainer`` (``fedgrid.integrations.transformers``, the ``transformers`` extra) and
Lightning's ``Trainer`` (``fedgrid.integrations.lightning``, the ``lightning`` extra). Both drive
one embedding session (``fedgrid.client.connect``) through ``fedgrid.integrations.federation``.

Nothing is imported here: each callback's module imports its trainer's package.
"""

__all__: list[str] = []
