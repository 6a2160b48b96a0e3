"""draftforge.train"""
