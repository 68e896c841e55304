"""What a dataset is made of: its index of files and documents, their fingerprints, the index file
written by ``prepare``, and how files are opened.
"""
