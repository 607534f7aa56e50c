"""minigpt's core: see README, "A map of the files"."""
