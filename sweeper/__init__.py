"""The sweeper service: resumes due pauses, purges cooldowns, rescues orphans."""
