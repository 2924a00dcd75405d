"""opd.gspo"""
