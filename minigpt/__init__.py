"""minigpt: a minimal GPT trainer that shows where the time and the memory go."""
