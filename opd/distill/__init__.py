"""opd.distill"""
