"""`megaft-chat`: talk to a run's newest checkpoint (LoRA adapters merged) or an HF
checkpoint in the terminal, with its chat template, answers streamed as they come;
one process or tensor parallel over local ranks. See docs/chat.md.

load.py finds the weights, tokenizer, template and stop ids; session.py holds the
conversation and its slash commands; engine.py generates (in process or over ranks);
terminal.py reads and prints; cli.py parses the command line.
"""
