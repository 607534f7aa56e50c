"""minigpt's instruments: see README, "A map of the files"."""
