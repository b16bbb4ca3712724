"""Text in and out: tokenizers, chat templates, incremental detokenization, tool-call and reasoning formats."""
