"""minigpt's instruments: see README, Layout."""
