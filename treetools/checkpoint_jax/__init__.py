"""Library checkpointing over the checkpoint I/O layer and the pytree toolkit: the Orbax manager and saving
(manager), restore, plan_restore and load_parameters from every format (restore).
"""
