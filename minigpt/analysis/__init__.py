"""minigpt's analysis: see README, "A map of the files"."""
