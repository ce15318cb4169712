"""Model-card templates (installed as ``hf_deltazip.model_cards``)."""
