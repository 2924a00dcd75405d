"""opd.expert"""
