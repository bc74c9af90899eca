"""What keeps people safe, shared by curation, serving, agents and synthesis alike: the harm scorer
(and the serving guardrails built on it), PII redaction, and the sandbox for untrusted code."""
