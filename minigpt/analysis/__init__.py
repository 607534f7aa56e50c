"""minigpt's analysis: see README, Layout."""
