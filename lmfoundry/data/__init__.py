"""Ray Data curation: sample corpus, normalisation, filters, dedup, tokenizer and packing."""
