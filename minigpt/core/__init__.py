"""minigpt's core: see README, Layout."""
