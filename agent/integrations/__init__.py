"""Thin adapters from training frameworks to :class:`fp8guard.agent.Monitor`.

Each lives in its own module and imports its framework only when that module is imported, so
``import fp8guard.agent`` never pulls in Lightning, transformers or Accelerate:

* :mod:`fp8guard.agent.integrations.lightning`: ``FP8GuardCallback`` for ``lightning.pytorch``
  (or ``pytorch_lightning``)::

      trainer = Trainer(callbacks=[FP8GuardCallback(MonitorConfig(url=URL, run_id="gpt-fp8"), heal=True),
                                   ModelCheckpoint(every_n_train_steps=100, save_top_k=-1)])

* :mod:`fp8guard.agent.integrations.hf`: ``FP8GuardTrainerCallback`` for the transformers
  ``Trainer``::

      trainer = Trainer(model, args, train_dataset=ds, callbacks=[FP8GuardTrainerCallback(MonitorConfig(url=URL), heal=True)])

* :mod:`fp8guard.agent.integrations.accelerate`: ``attach_accelerate`` (Accelerate has no
  callbacks: the loop calls ``monitor.step(loss)`` itself)::

      monitor = attach_accelerate(accelerator, model, optimizer, MonitorConfig(url=URL), heal=HealConfig("ckpt/"))
      for batch in monitor.batches(loader): ...

With ``heal`` each heals through the framework's own checkpoints (a rollback restores the
framework's checkpoint in place, skips the batches and lowers the learning rate as the command
says; fallback and promotion switch the named modules); ``_heal`` holds what they share. The
Monitor itself never stops training once attached; only configuration errors raise, when the
integration attaches (and a rollback that fails halfway in an Accelerate loop, whose state is
then neither the old nor the checkpoint's).
"""
